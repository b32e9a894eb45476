# The run bucket on GCS, with the same rules as the S3 one: versioned, encrypted (Google-managed or
# CMEK), no public access, uniform bucket-level access (GCS serves only TLS), lifecycle rules that
# delete merged deltas and old versions.

resource "google_storage_bucket" "run" {
  project                     = var.project
  name                        = var.bucket_name
  location                    = var.location
  force_destroy               = var.force_destroy
  uniform_bucket_level_access = true
  public_access_prevention    = "enforced"
  labels                      = var.labels

  versioning {
    enabled = true
  }

  dynamic "encryption" {
    for_each = var.kms_key_name == null ? [] : [var.kms_key_name]

    content {
      default_kms_key_name = encryption.value
    }
  }

  dynamic "logging" {
    for_each = var.access_log_bucket == null ? [] : [var.access_log_bucket]

    content {
      log_bucket = logging.value
    }
  }

  lifecycle_rule {
    action {
      type = "Delete"
    }

    condition {
      age            = var.delta_expiration_days
      matches_prefix = ["${var.run_prefix}/${var.delta_prefix}"]
      with_state     = "LIVE"
    }
  }

  lifecycle_rule {
    action {
      type = "Delete"
    }

    condition {
      days_since_noncurrent_time = var.noncurrent_version_expiration_days
      with_state                 = "ARCHIVED"
    }
  }
}
