"""Who may act on a session at a stage: the gateway connection that opened it, and its chain's stage before this one.

A gateway's HELLO opens its session here and binds it to that connection (and, on a keyed swarm,
the member its certificate names); a session is bound once: another connection naming it is
refused, and the binding, with the session's caches, ends when its connection closes. The HELLO
also says where the session's steps go next (`onward`, the next stage's address) and the two link
tokens of its chain (random, one per pair of neighbouring stages, made by the gateway):
`upstream`, what the stage before this one shows with each step it forwards, and `onward_token`,
what this stage shows the next. So a STEP is taken from the session's own gateway connection, or
from a stage connection showing the session's upstream token; any other connection naming the
session gets an error and nothing of its state. The next stage of a step is only the one the
gateway named: a stage dials nothing a step's route merely says.

Session ids are never logged whole (`tag`).
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass
from typing import Any

from moeswarm.errors import ProtocolError
from moeswarm.stages.protocol import MAX_SESSION_CHARS, Step

MAX_TOKEN_CHARS = 64
MAX_ADDRESS_CHARS = 300


@dataclass(frozen=True)
class Session:
    """A session as its gateway's HELLO opened it at this stage.

    owner: the connection (stages/server.py Connection) that opened it; member: its peer's member
    certificate (None on plain TCP). upstream: the token the stage before this one shows (None:
    this is the chain's first stage, and only the gateway sends its steps). onward, onward_token:
    the next stage's address and the token to show it (None: this is the last stage)."""

    id: str
    owner: Any
    member: str | None
    upstream: str | None
    onward: str | None
    onward_token: str | None


def tag(session: str) -> str:
    """What logs may show of a session id: its first 6 characters."""
    return (session[:6] + "...") if len(session) > 6 else session


def parse_hello(meta: dict, owner: Any, member: str | None) -> Session:
    """The Session a gateway's HELLO opens; ProtocolError naming the bad field."""
    session = meta.get("session")
    if not isinstance(session, str) or not 0 < len(session) <= MAX_SESSION_CHARS or not session.isprintable():
        raise ProtocolError(f"a gateway's HELLO names its session (1-{MAX_SESSION_CHARS} printable characters)")
    upstream, onward, onward_token = (meta.get(name) for name in ("upstream", "onward", "onward_token"))
    for name, value, bound in (("upstream", upstream, MAX_TOKEN_CHARS), ("onward", onward, MAX_ADDRESS_CHARS),
                               ("onward_token", onward_token, MAX_TOKEN_CHARS)):
        if value is not None and not (isinstance(value, str) and 0 < len(value) <= bound and value.isprintable()):
            raise ProtocolError(f"HELLO field {name!r} must be 1-{bound} printable characters")
    if (onward is None) != (onward_token is None):
        raise ProtocolError("HELLO fields 'onward' and 'onward_token' come together")
    return Session(session, owner, member, upstream, onward, onward_token)


def check_step(step: Step, session: Session | None, sender: Any, sender_is_stage: bool) -> None:
    """ProtocolError unless `sender` may send `step` (see the module's rules). The message says what
    the sender got wrong, nothing about the session."""
    if session is None:
        raise ProtocolError("no gateway has opened this session here (HELLO first, on its own connection)")
    if sender_is_stage:
        if session.upstream is None or not hmac.compare_digest(step.token.encode(), session.upstream.encode()):
            raise ProtocolError("this connection may not send steps of that session")
    elif session.owner is not sender:
        raise ProtocolError("this connection may not send steps of that session")
    if step.route and (session.onward is None or step.route[0] != session.onward):
        raise ProtocolError("the step's next stage is not the one its gateway named at HELLO")
    if not step.route and session.onward is not None:
        raise ProtocolError("the step ends here, but its gateway named a next stage at HELLO")
