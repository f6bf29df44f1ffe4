"""Gradient buckets for the data-parallel average under TP or PP (torch-free: the planner counts them).

Where DDP does not wrap the model (tp or pp > 1), the gradients are averaged over the dp group in
buckets of about `BUCKET_BYTES`, as DDP's own (its default `bucket_cap_mb` is 25), at most
`IN_FLIGHT` all-reduces at a time: the communication is pipelined, and the extra memory is that of
`IN_FLIGHT` buckets, not a flat copy of every gradient.
"""

from __future__ import annotations

BUCKET_BYTES = 25 * 2**20
IN_FLIGHT = 2


def buckets(nbytes: list[int], cap: int = BUCKET_BYTES) -> list[list[int]]:
    """Consecutive indices of tensors of `nbytes` each, grouped so that a group stays within `cap` bytes
    (a tensor larger than `cap` is a group of its own)."""
    groups: list[list[int]] = []
    size = 0
    for i, n in enumerate(nbytes):
        if not groups or size + n > cap:
            groups.append([])
            size = 0
        groups[-1].append(i)
        size += n
    return groups
