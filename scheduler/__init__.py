"""slotserve scheduler package."""
