"""One call's path: the input contract, the choice of program and the lanes that run it."""
