"""The test suite, a package so that tests import shared code as ``tests.helpers...`` with the repository
root on sys.path (pytest.ini ``pythonpath = .``), never by editing sys.path.

Tiers (folders; the marker of each is applied by tests/conftest.py, collected in this order):
``unit`` (in-process, fast), ``integration`` (torchrun, DeepSpeed, training runs, launchers and other
subprocesses, the real example), ``cluster`` (network namespaces: multi-node and Ray cluster runs).
"""
