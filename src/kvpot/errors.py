"""The one exception users see from kvpot."""


class KvpotError(ValueError):
    """A request kvpot refuses, with a sentence that says what to change.

    The CLI turns it into a one-line message on stderr and exit code 2.
    """
