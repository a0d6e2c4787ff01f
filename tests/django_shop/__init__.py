"""A minimal Django app for ``tests/integration/test_django.py``: one model and one view
function that saves an order and enqueues its job in the same transaction."""
