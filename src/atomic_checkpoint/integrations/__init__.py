"""Drop-in integrations with training frameworks.

These are the only modules of the package that import a framework; each one is
imported explicitly, e.g. ``from atomic_checkpoint.integrations.hf import make_atomic``,
so ``import atomic_checkpoint`` stays free of torch and of every framework.
"""
