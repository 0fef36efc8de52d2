"""Test-only model whose initialize raises, as a model with a bad checkpoint path would."""


class TritonPythonModel:
    def initialize(self, args):
        raise RuntimeError("checkpoint could not be loaded (deliberate test failure)")

    def execute(self, requests):
        raise NotImplementedError
