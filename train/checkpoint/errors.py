"""The one error type of checkpoint reading, apart so that both the layout and the safe loader raise it."""


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, incomplete or corrupt; the message names the checkpoint and file."""
