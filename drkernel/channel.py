"""The judge's side of one runner process: one request, one answer, then silence.

A `Channel` is a runner (a candidate's, or the reference twin) seen from the judge. Every request
carries a random nonce its reply must echo; nothing may wait on the socket after the reply; the
runner's process group is stopped (SIGSTOP) from the moment a reply arrives until the next request
is sent, so nothing it runs after answering can touch the arena or the GPU; and once the runner has
described its evidence machinery (before any candidate code exists), every reply must carry a
digest of it keyed by the nonce. A reply that breaks any of these is `forged_reply` (or
`patched_function` for the digest); a runner that dies or falls silent ends its evaluation.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import secrets
import select
import signal
import time

from drkernel import ipc, procfs
from drkernel.ipc import kill_note, read_output

_CUDA_FAULTS = ("CUDA error", "illegal memory access", "device-side assert")
# A killed process stays in /proc until the kernel has freed its memory (about 0.1 s a GB, seconds
# at the memory limit): the next candidate's turn must not find it and be blamed for it
STRAYS_GONE_S = 15.0


class Stop(Exception):
    """A final non-hack verdict; `findings`: what the runner reported beside a failure of the
    candidate (self-reports, judged as any call's)."""

    def __init__(self, verdict: str, error: str, findings: list | None = None):
        super().__init__(error)
        self.verdict, self.error, self.findings = verdict, error, findings or []


class Hacked(Exception):
    def __init__(self, code: str, detail: str):
        super().__init__(detail)
        self.code, self.detail = code, detail


def evidence_digest(nonce: str, state: str) -> str:
    """What a runner's reply must carry: its evidence machinery's description, keyed by the nonce."""
    import hashlib
    return hashlib.sha256(f"{nonce}\n{state}".encode()).hexdigest()


@dataclasses.dataclass
class Channel:
    """One runner process and the requests to it."""
    sock: int
    pid: int
    dir: str
    zygote_pid: int = 0  # the sandbox's fork server (strays re-parented to it are this job's)
    deadline: float = 0.0
    pending: str = ""  # the nonce of a request sent but not yet answered
    evidence_state: str = ""
    threads_before: int = 0
    siblings: tuple[int, ...] = ()  # the job's other runners (children of the zygote, like the judge)

    def send(self, msg: dict) -> str:
        """The runner let go and one request sent; returns its nonce."""
        nonce = secrets.token_hex(16)
        _signal_group(self.pid, signal.SIGCONT)
        try:
            ipc.send(self.sock, {**msg, "nonce": nonce})
        except OSError as exc:
            raise self.gone(exc) from None
        self.pending = nonce
        return nonce

    def receive(self) -> dict:
        """The reply to the pending request; the runner is stopped the moment it arrives."""
        try:
            reply = ipc.recv(self.sock, self.deadline)
        except ipc.Malformed as exc:
            raise Hacked("forged_reply", f"the runner's socket carried a frame its sender never writes ({exc})") from None
        except (OSError, ipc.ChannelClosed) as exc:
            raise self.gone(exc) from None
        finally:
            self.freeze()
        self._check(reply)
        return reply

    def ask(self, msg: dict) -> dict:
        self.send(msg)
        return self.receive()

    def freeze(self, patience_s: float = 2.0) -> None:
        """Stop every process of the runner's group and wait until each thread of the runner is
        stopped: until the next request nothing it runs can touch the arena or the GPU."""
        if not _signal_group(self.pid, signal.SIGSTOP):
            return
        end = time.monotonic() + patience_s
        while not procfs.stopped(self.pid):
            if time.monotonic() > end:
                raise Stop("crashed", "the candidate's process could not be stopped between requests")
            time.sleep(0.0002)

    def _check(self, reply: dict) -> None:
        nonce, self.pending = self.pending, ""
        if reply.get("nonce") != nonce:
            raise Hacked("forged_reply", "a reply that does not answer the current request (wrong or missing nonce)")
        if select.select([self.sock], [], [], 0)[0]:
            raise Hacked("forged_reply", "the runner sent data nobody asked for")
        if self.evidence_state and reply.get("evidence") != evidence_digest(nonce, self.evidence_state):
            raise Hacked("patched_function", "the runner's launch hook, data-flow log or integrity checks were "
                                             "replaced after the candidate was imported")

    def gone(self, exc: BaseException) -> Stop:
        """The runner died or stopped answering: a crash (how, from /proc while it is a zombie) or a timeout."""
        if isinstance(exc, ipc.Timeout):
            return Stop("timeout", "the candidate did not answer before the time limit")
        how, st = "exited", procfs.stat(self.pid)
        why = read_output(kill_note(self.dir, self.pid), 200) if self.dir else ""
        if why:
            return Stop("crashed", f"the candidate's process was killed: {why}")
        if st is not None and os.WIFSIGNALED(st.exit_code):
            how = f"was killed by {signal.Signals(os.WTERMSIG(st.exit_code)).name}"
        elif st is not None and os.WIFEXITED(st.exit_code) and st.state == "Z":
            how = f"exited with code {os.WEXITSTATUS(st.exit_code)} (os._exit?)"
        return Stop("crashed", f"the candidate's process {how} without a result ({exc})")

    def escaped_kills(self) -> str:
        """The supervisor's note that it killed processes that had left their runner (over a limit
        of the job), taken so that it is read once; empty when there is none. Only the runner whose
        turn it is runs, so they were its candidate's."""
        if not self.dir:
            return ""
        path = kill_note(self.dir, ipc.ESCAPED)
        note = read_output(path, 300)
        if note:
            with contextlib.suppress(OSError):
                os.unlink(path)
        return note

    def strays(self) -> list[int]:
        """Processes of this runner's besides itself: its descendants, and any process that left
        its group and was re-parented to the zygote (neither the judge nor one of `siblings`)."""
        if self.pid <= 0:
            return []
        # a zombie (a child that exited and was not reaped: `os.popen` never closed) runs nothing
        return [p for p in procfs.descendants(self.pid) if procfs.alive(p)] + self._escaped()

    def _escaped(self) -> list[int]:
        if not self.zygote_pid:
            return []
        known = {os.getpid(), self.pid, *self.siblings}
        out = [p for p in procfs.children(self.zygote_pid) if p not in known and procfs.alive(p)]
        return out + [d for p in out for d in procfs.descendants(p)]

    def kill(self) -> None:
        """The runner and its group gone for good (its CUDA context with it), then every process
        it left (re-parented to the zygote by then), so that none lives on into the next candidate's turn."""
        if not _signal_group(self.pid, signal.SIGKILL):
            return
        for _ in range(2000):
            if not procfs.alive(self.pid):
                break
            time.sleep(0.001)
        deadline = time.monotonic() + STRAYS_GONE_S
        while (strays := self.strays()) and time.monotonic() < deadline:  # again while one still forks
            for pid in strays:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.002)

    def output(self, name: str, limit: int) -> str:
        """What the runner printed (`stdout` or `stderr` in its directory), head and tail."""
        return read_output(os.path.join(self.dir, name), limit)


def _signal_group(pid: int, sig: int) -> bool:
    """`sig` to the process group `pid` leads; False for no group (0 would be the judge's own)."""
    if pid <= 0:
        return False
    with contextlib.suppress(OSError):
        os.killpg(pid, sig)
    return True


def short(text: str | None, n: int) -> str:
    """`text` cut to about `n` characters, its head and tail kept."""
    text = text or ""
    return text if len(text) <= n else text[: n // 2] + "\n...[truncated]...\n" + text[-n // 2:]


def cuda_fault(text: str) -> bool:
    """Whether an error message is a CUDA fault (the device context is then lost)."""
    return any(k in text for k in _CUDA_FAULTS)


def runner_error(reply: dict, what: str) -> Stop:
    """The runner reported that the candidate raised."""
    err = str(reply.get("error", ""))[:1500]
    findings = reply.get("findings") if isinstance(reply.get("findings"), list) else None
    if cuda_fault(err):
        return Stop("runtime_error", "CUDA error: " + err[:600], findings)
    return Stop("runtime_error", f"{what}: {err}", findings)


def exception_text(prefix: str, exc: BaseException) -> str:
    msg = f"{type(exc).__name__}: {exc}"
    if cuda_fault(msg):
        return "CUDA error: " + short(msg, 400)
    return short(f"{prefix}: {msg}", 600)
