"""Task loaders (HellaSwag), preprocessing identical to lm-eval."""
