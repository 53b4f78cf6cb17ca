"""The application layer: the command line, the batch runner, features, recipes, the HTML pages."""
