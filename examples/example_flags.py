"""Command-line flags that the example trainers share the shape of."""


def add_numbers(parser, **defaults):
    """Adds to argparse `parser`, in the keywords' order, a flag --NAME for each keyword NAME
    (its underscores as dashes) of its default's type (int or float), with that default."""
    for name, default in defaults.items():
        parser.add_argument("--" + name.replace("_", "-"), type=type(default), default=default)
