"""Errors a rank raises because another rank failed first.

A rank whose checkpoint folder was removed by another rank's failure (a full disk), or whose
collective peer is gone, fails too, often before the rank that caused it, and its error says
what happened to it, not why. Raised as a `FollowOnError`, it makes the group's wait
(`role_group.gather_all`) look for the other rank's failure within `DEATH_GRACE_S` and report
that one, the root cause.
"""


class FollowOnError(RuntimeError):
    """This rank failed because another rank did: the other rank's error is the one to report."""
