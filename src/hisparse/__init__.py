"""hisparse."""
