"""Errors a rank raises because another rank failed first.

A rank whose checkpoint folder another rank's failure removed, or whose collective peer is gone,
often fails first, with an error that says what happened to it, not why. A `FollowOnError` makes
the group's wait (`role_group.gather_all`) look for the other rank's failure within
`DEATH_GRACE_S` and report that root cause instead.
"""


class FollowOnError(RuntimeError):
    """This rank failed because another rank did: the other rank's error is the one to report."""
