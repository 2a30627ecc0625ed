"""What happens around one pipeline call: stage, step and interrupt hooks."""
