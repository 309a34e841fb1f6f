"""The `epd` command line: one console script whose subcommands start each role."""
