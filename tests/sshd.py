"""A real OpenSSH server on loopback addresses for the ssh launcher's tests (generated keys, no mock)."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from cona_cli.cluster.nodes import free_port


@dataclass
class Sshd:
    proc: subprocess.Popen
    port: int
    ssh_args: list[str]  # what cluster.ssh_args needs to reach it

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def sshd_binary() -> str | None:
    return shutil.which("sshd") or next((p for p in ("/usr/sbin/sshd",) if os.access(p, os.X_OK)), None)


def start_sshd(
    folder: Path,
    addrs: tuple[str, ...] = ("127.0.0.1", "127.0.0.2"),
    port: int | None = None,
    wrap: list[str] | None = None,
    user_key: Path | None = None,
) -> Sshd:
    """Start sshd listening on `addrs`; `wrap` prefixes its command (e.g. an `unshare` for a node that
    sees other storage); `user_key` is the client key to accept (default: a new one in `folder`).
    Keys and config live in `folder`."""
    binary = sshd_binary()
    assert binary, "sshd not installed"
    folder.mkdir(parents=True, exist_ok=True)
    host_key, user_key = folder / "host_key", user_key or folder / "id_ed25519"
    for key in (host_key, user_key):
        if not key.exists():
            subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
    shutil.copyfile(f"{user_key}.pub", folder / "authorized_keys")
    port = port or free_port("127.0.0.1")
    config = folder / "sshd_config"
    config.write_text(
        "\n".join(
            [
                *(f"ListenAddress {a}:{port}" for a in addrs),
                f"HostKey {host_key}",
                f"AuthorizedKeysFile {folder / 'authorized_keys'}",
                "PubkeyAuthentication yes",
                "PasswordAuthentication no",
                "KbdInteractiveAuthentication no",
                "PermitRootLogin prohibit-password",
                "StrictModes no",
                "UsePAM no",
                f"PidFile {folder / 'sshd.pid'}",
                "LogLevel ERROR",
                "",
            ]
        )
    )
    Path("/run/sshd").mkdir(parents=True, exist_ok=True)  # privilege separation folder
    (folder / "sshd.pid").unlink(missing_ok=True)
    proc = subprocess.Popen(
        [*(wrap or []), binary, "-D", "-e", "-f", str(config)],
        stdout=subprocess.DEVNULL,
        stderr=open(folder / "sshd.log", "w"),
    )
    deadline = time.monotonic() + 15
    while not (folder / "sshd.pid").exists():  # written once it listens (works inside a namespace too)
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"sshd did not start: {(folder / 'sshd.log').read_text()[-500:]}")
        time.sleep(0.1)
    args = [
        "-p",
        str(port),
        "-i",
        str(user_key),
        "-o",
        "StrictHostKeyChecking=no",
        "-o",
        "UserKnownHostsFile=/dev/null",
        "-o",
        "LogLevel=ERROR",
    ]
    return Sshd(proc, port, args)
