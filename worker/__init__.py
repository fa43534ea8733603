"""The card engine: reference model, checkpoint loading, sampling, sessions, decode loop."""
