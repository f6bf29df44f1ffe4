"""How a process of `launch` ends, as the controller reads it: the exit codes of a rank and of the storage
probe, and the error texts that mean a peer rank died. Both sides take them from here
(`cona_cli.control.failures` and `cona_cli.cluster.shared_storage` read them)."""

from __future__ import annotations

REFUSED_EXIT = 2  # a rank whose node cannot run the config (launch.device: DeviceError), after its one line
BAD_CHECKPOINT_EXIT = 3  # a rank that cannot load its checkpoint
OUT_OF_MEMORY_EXIT = 4  # a rank that ran out of device (or host) memory
STORAGE_EXIT = 5  # a rank whose checkpoint could not be written (launch.checkpoint), after its one line
# A rank that SIGTERM stopped (after it checkpointed with the others) exits with this code: it cannot tell
# its agent's stop from a stray signal, and an agent that is not stopping must see the launch fail.
SIGNALLED_EXIT = 143
PEER_LOST = (  # a rank's error when another rank died: gloo's and the TCP store's words, then NCCL's
    "Connection reset by peer",
    "Connection closed by peer",
    "Connection refused",
    "Connection was likely closed",
    "ncclRemoteError",
    "remote process exited or there was a network error",
    "NCCL communicator was aborted",
    "Watchdog caught collective operation timeout",
    "Some NCCL operations have failed or timed out",
)
# The storage probe's (launch.node.storage_probe): it ran and did not see the controller's file, or only
# other nodes' files were missing.
MISSING_NODES, MISSING_CONTROLLER = 1, 2
