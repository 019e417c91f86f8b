"""Console-script entry points; each is thin and calls a library below."""
