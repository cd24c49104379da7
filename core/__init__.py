"""slotserve core package."""
