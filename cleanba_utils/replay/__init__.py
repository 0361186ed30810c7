"""The off-policy scripts' data structures: the replay store (`store`) over its sum tree
(`sum_tree`), Ape-X DQN's stored single frames (`frame_ring`), n-step transitions (`n_step`), and
the learner on a prioritized replay (`prioritized_learning`)."""
