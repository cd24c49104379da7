"""slotserve agents package."""
