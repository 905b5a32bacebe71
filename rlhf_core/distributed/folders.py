"""A worker method that writes or reads a folder, with the folder on object storage.

The ranks of a role may run on several nodes, and a node's disk is its own: a checkpoint that the
ranks write into one local path lands in pieces on different machines. With an `s3://` folder each
rank writes into a staging folder of its own on its node (under the state directory), uploads what
it wrote and removes the folder; to read, each node downloads the folder once into its download
cache, which the ranks on the node share. Who decides that the folder is complete (a checkpoint's
`latest`) writes that after every rank's upload has returned. A local folder is passed as it is.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable

from rlhf_core.infra import storage


def save_to(write: Callable[[str], object], uri: str, owner: str, flag: str = "--ckpt.path") -> list[str]:
    """`write(folder)`, then the folder's files uploaded under `uri`; returns their relative paths.
    A full disk while staging is a DiskFullError naming `flag`."""
    if not storage.is_remote(uri):
        write(uri)
        return []
    local = storage.staging_folder(owner)
    try:
        with storage.saving(flag, local, f"{owner}'s part of {uri} (staged before its upload)",
                            "nothing of it was uploaded"):
            write(str(local))
        return storage.upload_folder(local, uri)
    finally:
        shutil.rmtree(local, ignore_errors=True)


def load_from(read: Callable[[str], object], uri: str):
    """`read(folder)` on a local copy of `uri` (downloaded into this node's cache unless local)."""
    if not storage.is_remote(uri):
        return read(uri)
    from rlhf_core.infra.settings import state_dir

    return read(storage.local_copy(uri, state_dir() / "cache"))
