"""Model-family specifics the generic engine does not need to know."""
