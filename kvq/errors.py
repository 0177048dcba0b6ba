class KvqError(ValueError):
    """A user error (bad config, unknown name, bad shape or bits).

    The CLI prints it as one line and exits with code 2; the library raises it and never exits.
    """
