"""Identity and authorization enforced by nats-server: NATS decentralized auth for reach.

An auth DIR holds an operator, a system account and one application account; every reach
process is a user of that account, with a user JWT whose permissions come from its role
(:data:`ROLES`): an *agent* may speak only for itself, a *caller* may route, call, submit
and read results, the *broker* may do what the broker does. The server refuses everything
else before any reach process sees it. Issuing a credential needs no server change;
revoking one reaches a running server through its system account.

    d = init("auth")                         # keys, server.conf, broker.creds
    issue_agent(d, "alpha")                  # auth/agents/alpha.creds
    issue_caller(d, "ops")                   # auth/callers/ops.creds
    revoke(d, "alpha"); await push_account(d, "nats://127.0.0.1:4222")
"""

from .bootstrap import init, write_server_conf
from .claims import AuthError
from .identities import (
    Identity,
    issue,
    issue_agent,
    issue_broker,
    issue_caller,
    list_identities,
    revoke,
)
from .layout import AuthDir, Meta
from .push import push_account
from .roles import BROKER_ACK_AUTHOR, ROLES, Role, RoleName, inbox_prefix, inbox_prefix_of

__all__ = [
    "BROKER_ACK_AUTHOR",
    "ROLES",
    "AuthDir",
    "AuthError",
    "Identity",
    "Meta",
    "Role",
    "RoleName",
    "inbox_prefix",
    "inbox_prefix_of",
    "init",
    "issue",
    "issue_agent",
    "issue_broker",
    "issue_caller",
    "list_identities",
    "push_account",
    "revoke",
    "write_server_conf",
]
