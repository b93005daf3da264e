"""OUT: checks, staging, locks, durable atomic publish, object storage, the Hub."""
