"""What every layer reads and nothing heavy: method and option names, where built files live, progress bars,
keyword checks."""
