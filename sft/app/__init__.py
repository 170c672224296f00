"""The application: the one training orchestrator (train.py) and the checks that span the wings (validation.py)."""
