"""Bridges to other protocols: Synadia agents, the HTTP sidecar, the A2A gateway, the MCP server."""
