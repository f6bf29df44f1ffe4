"""Helpers run on every node by the launchers: the ssh node agent and the shared-storage probe."""
