"""Real `moeswarm invite` and `moeswarm join` processes for `moeswarm bench swarm`, and what their lines say.

Each process's standard output is read by a thread that stamps every line with `time.monotonic()`
as it arrives; its standard error goes to a log file in the run's directory (named in any error).
The figures come from the lines the commands print anyway (commands/join.py, node/rebalancing.py):

    moeswarm worker: share: experts 0-15 of MoE layers 0-5 (...)          the share chosen
    moeswarm worker: fetched 1985440 bytes (0 resumed, 0 copied ...) into DIR/...gguf    a slice fetched (or: reusing DIR/...)
    moeswarm worker: announced on the swarm as 127.0.0.1:PORT (...)       serving, on the DHT
    moeswarm worker: moved: experts 8-23 announced as 127.0.0.1:PORT; ... a rebalancing move made

The swarm's processes are this checkout's: PYTHONPATH names it, so a bench run from anywhere
starts the same code. A keyed swarm's files are made here (transport/member_cert.py), as
`moeswarm keygen` makes them.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from moeswarm.errors import MoeSwarmError
from moeswarm.ids import parse_experts

PACKAGE_ROOT = Path(__file__).resolve().parents[3]  # the directory holding moeswarm/
START_S = 300.0  # the most a process is waited for to say what it is waited for


def environment() -> dict[str, str]:
    """The swarm processes' environment: this checkout first on the path, unbuffered output, no
    swarm key from the environment (each command is given its own --swarm-key, or none)."""
    env = {k: v for k, v in os.environ.items() if k != "MOESWARM_SWARM_KEY"}
    env["PYTHONPATH"] = os.pathsep.join([str(PACKAGE_ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    env["PYTHONUNBUFFERED"] = "1"
    return env


class Process:
    """A `moeswarm` command whose standard output lines are kept with the time each arrived."""

    def __init__(self, name: str, args: list[str], log: Path):
        self.name = name
        self.log = log
        self.lines: list[tuple[float, str]] = []
        self.changed = threading.Condition()
        self.started = time.monotonic()
        self.killed_at: float | None = None
        with log.open("w") as err:
            self.process = subprocess.Popen([sys.executable, "-m", "moeswarm.cli", *args], stdout=subprocess.PIPE,
                                            stderr=err, stdin=subprocess.DEVNULL, text=True, env=environment())
        self.reader = threading.Thread(target=self._read, name=f"lines of {name}", daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.process.stdout:
            with self.changed:
                self.lines.append((time.monotonic(), line.rstrip("\n")))
                self.changed.notify_all()
        with self.changed:
            self.changed.notify_all()

    def wait_for(self, marker: str, after: int = 0, wait_s: float = START_S) -> tuple[int, float, str]:
        """(index, time, line) of the first line from index `after` on that holds `marker`;
        MoeSwarmError when the process ends or `wait_s` passes first."""
        deadline = time.monotonic() + wait_s
        with self.changed:
            while True:
                for index in range(after, len(self.lines)):
                    if marker in self.lines[index][1]:
                        return (index, *self.lines[index])
                after = len(self.lines)
                if not self.reader.is_alive():
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    raise MoeSwarmError(f"{self.name} said no {marker!r} within {wait_s:g} s; its log: {self.log}")
                self.changed.wait(min(left, 1.0))
        raise MoeSwarmError(f"{self.name} ended (status {self.process.poll()}) before {marker!r}: "
                            f"{self.tail()} (log {self.log})")

    def tail(self, characters: int = 1500) -> str:
        try:
            return " ".join(self.log.read_text()[-characters:].split())
        except OSError:
            return ""

    def kill(self) -> float:
        """SIGKILL: no withdrawal, no goodbye; the time it was sent."""
        self.killed_at = time.monotonic()
        self.process.kill()
        self.process.wait()
        self.reader.join(10)
        return self.killed_at

    def terminate(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()

    def stop(self, wait_s: float = 15.0) -> None:
        """SIGTERM (a clean stop), SIGKILL after `wait_s`; then every line is read."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(wait_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.reader.join(10)


def start_inviter(model: Path, directory: Path, swarm_key: Path | None) -> tuple[Process, str]:
    """`moeswarm invite` of `model`: (the process, its invite)."""
    args = ["invite", "--model", str(model)] + (["--swarm-key", str(swarm_key)] if swarm_key else [])
    inviter = Process("moeswarm invite", args, directory / "invite.log")
    _, _, invite = inviter.wait_for("moeswarm-invite-1.")
    return inviter, invite.strip()


@dataclass(frozen=True)
class Fetch:
    at: float
    fetched_bytes: int
    resumed_bytes: int
    reused: bool  # the slice was in --dir already: nothing fetched


@dataclass(frozen=True)
class Move:
    at: float
    share: tuple[int, ...]
    address: str


class Joiner:
    """One `moeswarm join INVITE` of the bench, started again in the same --dir after a kill (a rejoin)."""

    def __init__(self, name: str, invite: str, directory: Path, memory_gb: float, flags: list[str],
                 swarm_key: Path | None):
        self.name = name
        self.invite = invite
        self.directory = directory
        self.memory_gb = memory_gb
        self.flags = flags
        self.swarm_key = swarm_key
        self.lives: list[Process] = []  # the first join, then each rejoin

    def start(self) -> Process:
        self.directory.mkdir(parents=True, exist_ok=True)
        args = ["join", self.invite, "--memory", f"{self.memory_gb:.9f}", "--dir", str(self.directory), "--threads", "1",
                *self.flags] + (["--swarm-key", str(self.swarm_key)] if self.swarm_key else [])
        life = Process(f"moeswarm join ({self.name}, start {len(self.lives) + 1})", args,
                       self.directory / f"join-{len(self.lives) + 1}.log")
        self.lives.append(life)
        return life

    @property
    def life(self) -> Process:
        return self.lives[-1]

    def serving(self, wait_s: float = START_S) -> "JoinFigures":
        """Waits until this life is announced on the swarm; its figures."""
        self.life.wait_for("announced on the swarm as ", wait_s=wait_s)
        return join_figures(self.life)

    def moves(self) -> list[Move]:
        return [move for life in self.lives for move in moves_of(life)]

    def share_at(self, when: float) -> tuple[int, ...] | None:
        """The experts this joiner served at time `when` (None: not serving then)."""
        for life in self.lives:
            figures = join_figures(life, complete=False)
            if figures is None or figures.announced_at > when or (life.killed_at is not None and life.killed_at <= when):
                continue
            share = figures.share
            for move in moves_of(life):
                if move.at <= when:
                    share = move.share
            return share
        return None

    def address_now(self) -> str | None:
        """The address the current life is announced at (the last move's), or None before it is announced."""
        figures = join_figures(self.life, complete=False)
        if figures is None:
            return None
        moved = moves_of(self.life)
        return moved[-1].address if moved else figures.address


@dataclass(frozen=True)
class JoinFigures:
    started: float
    share: tuple[int, ...]
    share_at: float  # chosen
    fetch: Fetch  # the first slice: the share's
    listening_at: float
    announced_at: float
    address: str

    def seconds(self) -> dict:
        return {"share_s": self.share_at - self.started, "fetched_s": self.fetch.at - self.started,
                "listening_s": self.listening_at - self.started, "announced_s": self.announced_at - self.started}


def join_figures(life: Process, complete: bool = True) -> JoinFigures | None:
    """What a join said up to its announcement; None (or MoeSwarmError with `complete`) before that."""
    share = share_at = fetch = listening = announced = address = None
    for at, line in list(life.lines):
        text = line.split("moeswarm worker: ", 1)[-1]
        if share is None and text.startswith("share: experts "):
            share, share_at = tuple(parse_experts(text.split()[2])), at
        elif fetch is None and share is not None and (text.startswith("fetched ") or text.startswith("reusing ")):
            fetch = _fetch(at, text)
        elif listening is None and text.startswith("listening on "):
            listening = at
        elif text.startswith("announced on the swarm as "):
            announced, address = at, text.split()[5]
            break
    if announced is None or share is None or fetch is None:
        if complete:
            raise MoeSwarmError(f"{life.name} announced itself without saying its share and fetch: {life.lines[-6:]}")
        return None
    return JoinFigures(life.started, share, share_at, fetch, listening or announced, announced, address)


def _fetch(at: float, text: str) -> Fetch:
    if text.startswith("reusing "):
        return Fetch(at, 0, 0, True)
    words = text.split()  # fetched N bytes (R resumed, C copied from the slice held before) into PATH
    return Fetch(at, int(words[1]), int(words[3].lstrip("(")), False)


def fetches_of(life: Process) -> list[Fetch]:
    """Every slice this life fetched or reused, its share's first, then its moves'."""
    return [_fetch(at, text) for at, line in list(life.lines)
            if (text := line.split("moeswarm worker: ", 1)[-1]).startswith(("fetched ", "reusing "))]


def moves_of(life: Process) -> list[Move]:
    out = []
    for at, line in list(life.lines):
        text = line.split("moeswarm worker: ", 1)[-1]
        if text.startswith("moved: experts "):
            words = text.split()  # moved: experts X announced as ADDR; ...
            out.append(Move(at, tuple(parse_experts(words[2])), words[5].rstrip(";")))
    return out


def make_keys(directory: Path, names: list[str]) -> dict[str, Path]:
    """A keyed swarm's files: the swarm key, then a member file per name, as `moeswarm keygen` writes them."""
    from moeswarm.transport.member_cert import write_member
    from moeswarm.transport.tls import write_swarm_key

    swarm_key = write_swarm_key(directory / "swarm.key")
    return {name: Path(write_member(swarm_key, name, directory / f"{name}.pem")) for name in names}
