"""Fake ``modules.call_queue``: the lock generations hold."""

import threading

queue_lock = threading.Lock()
