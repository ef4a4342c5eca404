"""Agent programs that tests start as separate processes, and the helper that runs them."""
