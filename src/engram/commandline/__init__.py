"""The command-line machinery every command is built with, knowing none of them (the commands are
``engram.cli``): ``schema`` reads a config dataclass's fields from its source without importing its
module, ``options`` turns configs into options, ``configfile`` reads and writes ``--config`` /
``--print_config`` files, ``command`` declares one subcommand and applies the output rule.

A foundation: imports only errors and outputs of engram, and no torch (``engram --help`` stays
fast); import its modules by name (``from engram.commandline.command import Arg``)."""
