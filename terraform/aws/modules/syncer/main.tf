# The syncer: one small on-demand VM next to the bucket. It merges deltas and publishes globals;
# if it dies, learners keep training on the last global and the syncer resumes from syncer/state/.

data "aws_region" "current" {}

data "aws_ssm_parameter" "image" {
  count = var.image_id == null ? 1 : 0
  name  = var.image_ssm_parameter
}

locals {
  deploy_dir = coalesce(var.deploy_dir, "${path.module}/../../../../deploy")
  image_id   = var.image_id != null ? var.image_id : nonsensitive(data.aws_ssm_parameter.image[0].value)

  env_file = templatefile("${local.deploy_dir}/env/ddiloco-geo.env.tmpl", {
    role          = "syncer"
    run_id        = var.run_id
    store_url     = var.store_url
    bucket_region = var.bucket_region
    region        = data.aws_region.current.name
    extra_env     = join("\n", [for k, v in var.settings : "${k}=${v}"])
  })

  user_data = templatefile("${local.deploy_dir}/cloud-init/syncer.yaml.tmpl", {
    cloud                 = "aws"
    fleet                 = ""
    package_spec          = var.package_spec
    lifecycle_hook        = ""
    web_identity_role_arn = ""
    env_b64               = base64encode(local.env_file)
    unit_b64              = filebase64("${local.deploy_dir}/systemd/ddiloco-geo@.service")
    node_agent_unit_b64   = filebase64("${local.deploy_dir}/systemd/ddiloco-node-agent.service")
    node_setup_b64        = filebase64("${local.deploy_dir}/bin/ddiloco-node-setup")
    node_agent_b64        = filebase64("${local.deploy_dir}/bin/ddiloco-node-agent")
  })
}

resource "aws_instance" "syncer" {
  ami                    = local.image_id
  instance_type          = var.instance_type
  subnet_id              = var.subnet_id
  vpc_security_group_ids = concat([aws_security_group.egress.id], var.security_group_ids)
  iam_instance_profile   = var.instance_profile_name
  user_data_base64       = base64encode(local.user_data)
  ebs_optimized          = true
  monitoring             = true

  metadata_options {
    http_endpoint               = "enabled"
    http_tokens                 = "required"
    http_put_response_hop_limit = 1
  }

  root_block_device {
    volume_size           = var.root_volume_gb
    volume_type           = "gp3"
    encrypted             = true
    delete_on_termination = true
  }

  tags        = merge(var.tags, { Name = var.name, "ddiloco-role" = "syncer" })
  volume_tags = var.tags
}

resource "aws_security_group" "egress" {
  name_prefix = "${var.name}-"
  description = "ddiloco-geo syncer: no inbound, HTTPS/HTTP out (S3, package index)"
  vpc_id      = var.vpc_id
  tags        = var.tags

  egress {
    description = "HTTPS to S3, STS and the package index"
    from_port   = 443
    to_port     = 443
    protocol    = "tcp"
    cidr_blocks = ["0.0.0.0/0"]
  }

  egress {
    description = "HTTP to the OS package mirrors"
    from_port   = 80
    to_port     = 80
    protocol    = "tcp"
    cidr_blocks = ["0.0.0.0/0"]
  }

  lifecycle {
    create_before_destroy = true
  }
}
