"""``python -m asyncrunner``: the same command line as ``asyncrunner``."""

# Worker processes re-run this module as ``__mp_main__``: only a real ``-m`` run starts a command.
if __name__ == "__main__":
    import sys

    from asyncrunner._cli import console

    sys.exit(console())
