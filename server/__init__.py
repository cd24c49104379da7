"""slotserve server package."""
