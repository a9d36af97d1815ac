"""Where training data come from: Medical Segmentation Decathlon folders, synthetic sets, S3 and whole-slide images."""
