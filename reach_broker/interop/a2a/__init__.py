"""The A2A registry and gateway (``reach broker --a2a-port N``; the optional extra ``a2a``).

:mod:`.cards` builds Agent Cards from the registry (no SDK needed), :mod:`.handler` turns
A2A messages into reach calls and back, :mod:`.local` routes the gateway's client through
the broker's own router, :mod:`.app` is the HTTP surface and :mod:`.gateway` the component
the broker process starts. Only :mod:`.cards` may be imported without the extra.
"""
