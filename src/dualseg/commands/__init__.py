"""``dualseg`` subcommands: one module per command, each with ``main(argv) -> int``."""
