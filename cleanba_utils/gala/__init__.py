"""GALA-A2C's own plumbing: the agents' arrays on shared devices (`agent_arrays`), their distance
to their average (`consensus`), and the asynchronous gossip's mailboxes (`mailboxes`)."""
