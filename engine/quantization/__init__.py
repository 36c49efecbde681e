"""Weight formats stored in fewer bits than the model's dtype, and how a checkpoint declares them."""
