"""The mailboxes of agents that gossip without waiting (GALA's --gossip async): each agent posts
its parameters to its out-peers' mailboxes and takes what has arrived in its own."""

import threading
from typing import NamedTuple

from cleanba_utils.threads import POLL_SECONDS, Stopped


class Message(NamedTuple):
    sender: int
    version: int  # the sender's update count when it sent the message
    params: dict


class Mailbox:
    """An agent's incoming messages in --gossip async: one slot per in-peer, written without
    waiting. A message from a peer whose previous one is unread overwrites it (counted), so the
    receiver mixes with the newest parameters sent to it; the GALA authors' code drops the new
    message instead, leaving older ones to mix with."""

    def __init__(self):
        self.slots = {}
        self.finished = set()
        self.overwritten = 0
        self.condition = threading.Condition()

    def post(self, message: Message):
        with self.condition:
            self.overwritten += message.sender in self.slots
            self.slots[message.sender] = message
            self.condition.notify_all()

    def close(self, sender: int):
        """The sender made its last update: nobody waits for it any more."""
        with self.condition:
            self.finished.add(sender)
            self.condition.notify_all()

    def take(self, wait_for: list, stop: threading.Event) -> list:
        """Every unread message, by sender; first waits until each running sender in `wait_for` has
        left one."""
        with self.condition:
            while any(s not in self.slots and s not in self.finished for s in wait_for):
                if stop.is_set():
                    raise Stopped
                self.condition.wait(POLL_SECONDS)
            return [self.slots.pop(sender) for sender in sorted(self.slots)]


def broadcast(mailboxes: list, out_peers: list, message: Message):
    for peer in out_peers:
        mailboxes[peer].post(message)


def receive(mailbox: Mailbox, silent: dict, staleness_bound: int, stop: threading.Event) -> list:
    """After a local update: the messages to mix with. `silent[j]` counts the local updates since
    the last message from in-peer j; with a bound τ > 0, the agent waits only for the in-peers
    silent for τ updates. Algorithm 1 mixes only once a message from every in-peer is there; with
    the paper's one in-peer that is the same as mixing whatever has arrived, which this does."""
    for sender in silent:
        silent[sender] += 1
    wait_for = [
        sender for sender, count in silent.items() if staleness_bound and count >= staleness_bound
    ]
    messages = mailbox.take(wait_for, stop)
    for message in messages:
        silent[message.sender] = 0
    return messages
