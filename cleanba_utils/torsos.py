"""Which torso a discrete script's network gives image observations, and its options: the default
channels of the torsos that the Q-learning and A2C scripts choose with --torso, the check of
--channels, and Young & Tian's (2019) MinAtar torso for small images (MinAtar's 10x10), which every
discrete script gives them. Each script defines the torsos it uses, with its network: what a
reader of one script reads is in that file."""

from cleanba_utils.errors import fail

TORSO_CHANNELS = {"nature": (32, 64, 64), "impala": (16, 32, 32), "minatar": (16,)}
"""--torso nature: the Nature DQN's; --torso impala: the IMPALA paper's, one per ResNet stack;
--torso minatar: Young & Tian's (2019), one per 3x3 convolution"""

MINATAR_HIDDENS = (128,)
"""The dense layer after the convolution of Young & Tian's (2019) MinAtar network."""

CPU_SIZED = "--channels 4 8 --hiddens 64 --local-num-envs 8 --num-steps 32 --total-timesteps 100000"
"""PPO's and IMPALA's options for an Atari run sized for a CPU (the README's "Try it on a CPU")"""


def observes_small_images(env_id: str) -> bool:
    """Images that are not Atari's frames (uint8 pixels) but small grids of features, as MinAtar's
    10x10 channels of 0 and 1: a JAX environment's float images. Every discrete script gives them
    `MinAtarTorso` (Young & Tian, 2019: the network MinAtar was published with, sized for 10x10
    inputs; the Atari torsos' strides and pools would shrink such an image to almost nothing)."""
    from cleanba_utils.envs import task_spaces

    space = task_spaces(env_id)[0]
    return len(space.shape) == 3 and space.dtype != "uint8"


def resolve_image_defaults(args, atari_channels: tuple[int, ...], atari_hiddens: tuple[int, ...]):
    """Gives --channels and --hiddens left unset (None) their default for the task's observations:
    Young & Tian's 16 channels and 128 units for small images, the script's own otherwise
    (--channels only with images)."""
    from cleanba_utils.envs import has_image_observations

    small = observes_small_images(args.env_id)
    if args.channels is None and has_image_observations(args.env_id):
        args.channels = TORSO_CHANNELS["minatar"] if small else atari_channels
    if args.hiddens is None:
        args.hiddens = MINATAR_HIDDENS if small else atari_hiddens


def torso_channels(args) -> tuple[int, ...]:
    """--channels, or the chosen torso's own."""
    return TORSO_CHANNELS[args.torso] if args.channels is None else args.channels


def check_torso_channels(args):
    if args.torso == "nature" and len(torso_channels(args)) != 3:
        fail(
            "--torso nature has three convolutions: --channels takes 3 values, got "
            f"{len(args.channels)}"
        )
