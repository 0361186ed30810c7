"""The convolutional torsos of image observations (N, H, W, C) that the Q-learning and A2C scripts
choose with --torso, their default channels, and the check of --channels; the torso of small
images (MinAtar's 10x10), which every discrete script gives them."""

from collections.abc import Callable

import flax.linen as nn

from cleanba_utils.errors import fail
from cleanba_utils.max_pool import max_pool_3x3_stride_2

TORSO_CHANNELS = {"nature": (32, 64, 64), "impala": (16, 32, 32), "minatar": (16,)}
"""--torso nature: the Nature DQN's; --torso impala: the IMPALA paper's, one per ResNet stack;
--torso minatar: Young & Tian's (2019), one per 3x3 convolution"""

MINATAR_HIDDENS = (128,)
"""The dense layer after the convolution of Young & Tian's (2019) MinAtar network."""


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


class NatureTorso(nn.Module):
    """The convolutions of the Nature DQN (Mnih et al., 2015), also the torso of the Dueling DDQN
    agent and of Dhariwal et al.'s (2017) A2C: 8x8 stride 4, 4x4 stride 2, 3x3 stride 1, no
    padding, ReLU."""

    channels: tuple[int, ...]
    kernel_init: Callable = nn.linear.default_kernel_init

    @nn.compact
    def __call__(self, x):
        for channels, size, stride in zip(self.channels, (8, 4, 3), (4, 2, 1)):
            conv = nn.Conv(
                channels,
                (size, size),
                strides=(stride, stride),
                padding="VALID",
                kernel_init=self.kernel_init,
            )
            x = nn.relu(conv(x))
        return x.reshape(x.shape[0], -1)


class MinAtarTorso(nn.Module):
    """Young & Tian's (2019) MinAtar network's torso: a 3x3 convolution of stride 1, no padding, per
    entry of `channels` (theirs: one of 16), ReLU; flattened."""

    channels: tuple[int, ...]

    @nn.compact
    def __call__(self, x):
        for channels in self.channels:
            x = nn.relu(nn.Conv(channels, (3, 3), padding="VALID")(x))
        return x.reshape(x.shape[0], -1)


class ResidualBlock(nn.Module):
    channels: int

    @nn.compact
    def __call__(self, x):
        y = nn.Conv(self.channels, (3, 3))(nn.relu(x))
        y = nn.Conv(self.channels, (3, 3))(nn.relu(y))
        return x + y


class ImpalaTorso(nn.Module):
    """The IMPALA ResNet: per stack, a convolution, a max pool and two residual blocks."""

    channels: tuple[int, ...]

    @nn.compact
    def __call__(self, x):
        for channels in self.channels:
            x = nn.Conv(channels, (3, 3))(x)
            x = max_pool_3x3_stride_2(x)
            x = ResidualBlock(channels)(ResidualBlock(channels)(x))
        return nn.relu(x).reshape(x.shape[0], -1)
