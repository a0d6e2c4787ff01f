"""The protocol both ends speak: messages, their codec and framing, the error table, credentials
and TLS. It knows nothing of tasks, rules or programs, so the main, the worker and the client
share it unchanged.
"""
