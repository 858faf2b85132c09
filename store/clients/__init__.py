"""Back-end clients of a store node: producers and consumer groups, for trio (producer.py, consumer.py), blocking
code (blocking.py) and asyncio (aio.py); the last two run the trio clients on a thread of their own (threaded.py)."""
