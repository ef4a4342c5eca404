"""The compensation replay: queued entries sent to agents again, held until their final ack
record."""
