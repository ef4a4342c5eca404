"""The caller: ``Client`` and how a call is routed, attempted, retried, streamed and waited for."""
