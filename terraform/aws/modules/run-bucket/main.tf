# The run bucket: versioned, encrypted, private, TLS-only, with lifecycle rules that expire merged
# deltas and old versions. Learners and the syncer share nothing but this bucket.

resource "aws_s3_bucket" "run" {
  bucket        = var.bucket_name
  force_destroy = var.force_destroy
  tags          = var.tags
}

resource "aws_s3_bucket_versioning" "run" {
  bucket = aws_s3_bucket.run.id

  versioning_configuration {
    status = "Enabled"
  }
}

resource "aws_s3_bucket_server_side_encryption_configuration" "run" {
  bucket = aws_s3_bucket.run.id

  rule {
    apply_server_side_encryption_by_default {
      sse_algorithm     = var.kms_key_arn == null ? "AES256" : "aws:kms"
      kms_master_key_id = var.kms_key_arn
    }
    bucket_key_enabled = var.kms_key_arn != null
  }
}

resource "aws_s3_bucket_public_access_block" "run" {
  bucket = aws_s3_bucket.run.id

  block_public_acls       = true
  block_public_policy     = true
  ignore_public_acls      = true
  restrict_public_buckets = true
}

resource "aws_s3_bucket_ownership_controls" "run" {
  bucket = aws_s3_bucket.run.id

  rule {
    object_ownership = "BucketOwnerEnforced"
  }
}

resource "aws_s3_bucket_lifecycle_configuration" "run" {
  bucket = aws_s3_bucket.run.id

  # Lifecycle rules on an unversioned bucket are rejected for noncurrent versions.
  depends_on = [aws_s3_bucket_versioning.run]

  rule {
    id     = "expire-deltas"
    status = "Enabled"

    filter {
      prefix = "${var.run_prefix}/${var.delta_prefix}"
    }

    expiration {
      days = var.delta_expiration_days
    }
  }

  rule {
    id     = "expire-noncurrent-versions"
    status = "Enabled"

    filter {
      prefix = "${var.run_prefix}/"
    }

    noncurrent_version_expiration {
      noncurrent_days = var.noncurrent_version_expiration_days
    }

    expiration {
      expired_object_delete_marker = true
    }
  }

  rule {
    id     = "abort-incomplete-uploads"
    status = "Enabled"

    filter {
      prefix = "${var.run_prefix}/"
    }

    abort_incomplete_multipart_upload {
      days_after_initiation = 1
    }
  }
}

resource "aws_s3_bucket_logging" "run" {
  count = var.access_log_bucket == null ? 0 : 1

  bucket        = aws_s3_bucket.run.id
  target_bucket = var.access_log_bucket
  target_prefix = "s3/${var.bucket_name}/"
}

data "aws_iam_policy_document" "bucket" {
  statement {
    sid     = "DenyInsecureTransport"
    effect  = "Deny"
    actions = ["s3:*"]
    resources = [
      aws_s3_bucket.run.arn,
      "${aws_s3_bucket.run.arn}/*",
    ]

    principals {
      type        = "*"
      identifiers = ["*"]
    }

    condition {
      test     = "Bool"
      variable = "aws:SecureTransport"
      values   = ["false"]
    }
  }

  dynamic "statement" {
    for_each = length(var.writer_principal_arns) > 0 ? [1] : []

    content {
      sid    = "DenyWritesByOthers"
      effect = "Deny"
      actions = [
        "s3:PutObject",
        "s3:DeleteObject",
        "s3:DeleteObjectVersion",
        "s3:RestoreObject",
      ]
      resources = ["${aws_s3_bucket.run.arn}/*"]

      principals {
        type        = "*"
        identifiers = ["*"]
      }

      condition {
        test     = "ArnNotLike"
        variable = "aws:PrincipalArn"
        values   = var.writer_principal_arns
      }
    }
  }
}

resource "aws_s3_bucket_policy" "run" {
  bucket = aws_s3_bucket.run.id
  policy = data.aws_iam_policy_document.bucket.json

  # The public access block must exist first, or AWS may reject the policy call.
  depends_on = [aws_s3_bucket_public_access_block.run]
}
