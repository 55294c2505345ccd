"""What the model drafters are made of: draft networks, their memory and heads."""
