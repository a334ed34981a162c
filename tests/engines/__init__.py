"""Real inference engines for the test suite: their environments and models, made on demand."""
